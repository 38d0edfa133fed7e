"""Top-k routing of a MoE block: router logits [..., experts] -> (experts [..., k] uint32, routing
weights [..., k] in the logits' dtype); Inkling's kind ("sigmoid_topk") also gives its shared
experts' weights, and takes its correction bias and global scale; DeepSeek-V4's
("sqrtsoftplus_topk") takes its correction bias and gives float32 weights, as its gate does, and
its token-hash layers' ("sqrtsoftplus_hash") take each token's experts from the layer's table
(`expert_table[token_ids]`) and weigh them as the others.

Reference: upstream's own expressions per kind (`Routing`), so that it reproduces stock bit for
bit. CUDA kernel (`cuda/moe_router.cu`): all of a kind's steps in one launch, one warp per token
(stock: four to six launches); MLX_MOE_FIX_CUDA_ROUTER=0 turns it off. It reproduces stock's routing
on MLX's CUDA backend bit for bit, ties and the order of the k included (there argpartition is a
stable sort, and the kernel follows MLX's softmax and sum kernels step by step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from ..env import flag
from .backend import Implementation, choose, current_backend
from .launch import cuda_kernel_object, float_array, int_array

CUDA_KERNEL_SWITCH = "MLX_MOE_FIX_CUDA_ROUTER"
KINDS = ("softmax_topk", "topk_softmax", "topk_softmax_last", "sigmoid_topk", "sqrtsoftplus_topk", "sqrtsoftplus_hash")
SQRTSOFTPLUS_KINDS = ("sqrtsoftplus_topk", "sqrtsoftplus_hash")
MAX_TOP_K = 32  # lane j of the token's warp writes choice j
WARPS_PER_BLOCK = 4
# The kernel's parameters, in the order of its `inputs` / outputs.
INPUTS = {"topk": ["logits", "sizes"], "sigmoid_topk": ["logits", "correction", "global_scale", "sizes", "params"],
          "sqrtsoftplus_topk": ["logits", "correction", "sizes", "params"],
          "sqrtsoftplus_hash": ["logits", "token_ids", "expert_table", "sizes", "params"]}
OUTPUTS = {"topk": ["indices", "weights"], "sigmoid_topk": ["indices", "weights", "shared_weights"],
           "sqrtsoftplus_topk": ["indices", "weights"], "sqrtsoftplus_hash": ["indices", "weights"]}


@dataclass(frozen=True)
class Routing:
    """kind "softmax_topk": softmax over all experts, the k largest probabilities, divided by
    their sum where `normalize` (qwen3_moe); "topk_softmax": the k largest logits, softmax over
    them (mixtral); "topk_softmax_last": the same, the k taken from the end of an argpartition as
    gpt-oss's `mlx_topk` does (the reference keeps each model's order of the k, which the
    weighted sum over them follows); "sigmoid_topk": Inkling's (InklingSparseMoE._route): the k
    largest sigmoid(logit) + correction bias among the first experts, then a softmax over the
    log-sigmoids of their logits and of the last `shared` (always-on) experts' logits, times
    `scale` (route_scale) and the global scale; the shared experts' weights come repeated over
    their `shared_width` intermediate columns each (the dense shared experts' layout; 1: one
    weight a shared expert, with no op to repeat them); "sqrtsoftplus_topk": DeepSeek-V4's
    (deepseek_v4.language._expert_select with its sqrt-softplus scoring): the k largest
    sqrt(softplus(logit)) + correction bias, their scores in float32, divided by their sum (plus
    1e-20) where `normalize`, times `scale` (routed_scaling_factor); "sqrtsoftplus_hash":
    DeepSeek-V4's token-hash layers (_hash_expert_select): the k experts of each token's id in the
    layer's table, weighed as sqrtsoftplus_topk's (no correction bias)."""

    kind: str
    top_k: int
    normalize: bool = False
    shared: int = 0
    shared_width: int = 0
    scale: float = 1.0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown routing kind {self.kind!r}; expected one of {KINDS}")
        if self.normalize and self.kind not in ("softmax_topk", *SQRTSOFTPLUS_KINDS):
            raise ValueError("normalize applies to softmax_topk and sqrt-softplus routing only")
        if self.kind != "sigmoid_topk" and (self.shared or self.shared_width):
            raise ValueError("shared experts apply to sigmoid_topk routing only")
        if self.kind not in ("sigmoid_topk", *SQRTSOFTPLUS_KINDS) and self.scale != 1.0:
            raise ValueError("a scale applies to sigmoid_topk and sqrt-softplus routing only")


def moe_router_reference(
    logits: mx.array, routing: Routing, correction_bias: Optional[mx.array] = None,
    global_scale: Optional[mx.array] = None, token_ids: Optional[mx.array] = None,
    expert_table: Optional[mx.array] = None,
) -> tuple:
    """correction_bias [experts]: sigmoid_topk's and sqrtsoftplus_topk's; global_scale [1]:
    sigmoid_topk's; token_ids [...] (the logits' leading shape) and expert_table [vocabulary, k]:
    sqrtsoftplus_hash's; None for the others."""
    k = routing.top_k
    if routing.kind == "sigmoid_topk":
        return _sigmoid_topk_reference(logits, routing, correction_bias, global_scale)
    if routing.kind == "sqrtsoftplus_topk":
        scores = sqrt_softplus(logits)
        return _sqrtsoftplus_weights(scores, mx.argpartition(-(scores + correction_bias), kth=k - 1, axis=-1)[..., :k], routing)
    if routing.kind == "sqrtsoftplus_hash":
        return _sqrtsoftplus_weights(sqrt_softplus(logits), expert_table[token_ids], routing)
    if routing.kind == "softmax_topk":
        gates = mx.softmax(logits, axis=-1, precise=True)
        indices = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]
        weights = mx.take_along_axis(gates, indices, axis=-1)
        if routing.normalize:
            weights = weights / mx.sum(weights, axis=-1, keepdims=True)
        return indices, weights
    if routing.kind == "topk_softmax":
        indices = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]
    else:
        indices = mx.argpartition(logits, kth=-k, axis=-1)[..., -k:]
    weights = mx.softmax(mx.take_along_axis(logits, indices, axis=-1), axis=-1, precise=True)
    return indices, weights


def _sigmoid_topk_reference(logits, routing: Routing, correction_bias, global_scale) -> tuple:
    """Upstream's expressions (InklingSparseMoE._route off Metal), for logits [..., experts + shared]."""
    experts = logits.shape[-1] - routing.shared
    scores = mx.sigmoid(logits.astype(mx.float32))[..., :experts] + correction_bias
    indices = mx.argpartition(-scores, routing.top_k - 1, axis=-1)[..., : routing.top_k]
    chosen = mx.take_along_axis(logits[..., :experts], indices, axis=-1)
    log_sigmoid = -mx.logaddexp(0.0, -mx.concatenate([chosen, logits[..., experts:]], axis=-1).astype(mx.float32))
    weights = mx.exp(log_sigmoid - mx.logsumexp(log_sigmoid, axis=-1, keepdims=True)) * routing.scale * global_scale
    shared = mx.repeat(weights[..., routing.top_k :].astype(logits.dtype), routing.shared_width, axis=-1)
    return indices.astype(mx.uint32), weights[..., : routing.top_k].astype(logits.dtype), shared


def sqrt_softplus(logits):
    """DeepSeek-V4's scores (deepseek_v4.language._score_func "sqrtsoftplus", of float32 logits)."""
    return mx.sqrt(mx.logaddexp(logits.astype(mx.float32), 0))  # nn.softplus


def _sqrtsoftplus_weights(scores, indices, routing: Routing) -> tuple:
    """Upstream's weights of the chosen experts (deepseek_v4.language._expert_select and
    _hash_expert_select after their choice)."""
    weights = mx.take_along_axis(scores, indices, axis=-1)
    if routing.normalize:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return indices.astype(mx.uint32), weights * routing.scale


def cuda_unsupported_reason(logits_dtype, width: int, routing: Routing) -> Optional[str]:
    """Why the kernel cannot route logits of `logits_dtype` and `width` columns (the routed
    experts', then the shared ones'), or None."""
    if logits_dtype not in (mx.bfloat16, mx.float16, mx.float32):
        return f"router logits of {logits_dtype}"
    if routing.top_k + routing.shared > MAX_TOP_K:
        return f"top-{routing.top_k} routing with {routing.shared} shared experts: the router kernel weighs at most {MAX_TOP_K}"
    if routing.kind == "sqrtsoftplus_hash":
        return None  # it reads the chosen experts' logits alone, whatever their number
    # A warp holds the logits as MLX's softmax reads them: 16 bytes of them per lane.
    most = 32 * 16 // logits_dtype.size
    experts = width - routing.shared
    if experts > most or routing.top_k > experts:
        return f"{experts} experts for top-{routing.top_k}: the router kernel takes up to {most} of {logits_dtype}"
    return None


def moe_router_kernel(
    logits: mx.array, routing: Routing, correction_bias: Optional[mx.array] = None,
    global_scale: Optional[mx.array] = None, token_ids: Optional[mx.array] = None,
    expert_table: Optional[mx.array] = None,
) -> tuple:
    """The CUDA implementation; same contract as moe_router_reference."""
    width = logits.shape[-1]
    tokens = logits.size // width
    experts = width - routing.shared
    section = routing.kind if routing.kind in ("sigmoid_topk", *SQRTSOFTPLUS_KINDS) else "topk"
    kernel = cuda_kernel_object("moe_router.cu", section, tuple(INPUTS[section]), tuple(OUTPUTS[section]), 0)
    threads = WARPS_PER_BLOCK * 32
    weights_dtype = mx.float32 if section in SQRTSOFTPLUS_KINDS else logits.dtype
    # the logits in their own shape, the outputs in theirs: the kernel reads and writes rows of
    # contiguous memory (MLX copies an input that is not), and a reshape would be a node
    if section == "topk":
        inputs = [logits, int_array(tokens, experts, routing.top_k)]
        template = [("T", logits.dtype), ("SOFTMAX_FIRST", routing.kind == "softmax_topk"),
                    ("NORMALIZE", routing.normalize), ("LAST_K", routing.kind != "topk_softmax")]
    elif section == "sigmoid_topk":
        inputs = [logits, correction_bias, global_scale, int_array(tokens, experts, routing.top_k, routing.shared),
                  float_array(routing.scale)]
        template = [("T", logits.dtype)]
    elif section == "sqrtsoftplus_topk":
        inputs = [logits, correction_bias, int_array(tokens, experts, routing.top_k), float_array(routing.scale)]
        template = [("T", logits.dtype), ("NORMALIZE", routing.normalize)]
    else:
        for name, table in (("token ids", token_ids), ("expert table", expert_table)):
            if not mx.issubdtype(table.dtype, mx.integer):
                raise ValueError(f"{name} of {table.dtype}: hash routing gathers with integer indices")
        if token_ids.size != tokens or expert_table.shape[-1] != routing.top_k:
            raise ValueError(f"token ids {token_ids.shape} and expert table {expert_table.shape} for {tokens} tokens' "
                             f"top-{routing.top_k}: one id a token, {routing.top_k} experts an id")
        inputs = [logits, token_ids, expert_table, int_array(tokens, experts, routing.top_k, expert_table.shape[0]),
                  float_array(routing.scale)]
        template = [("T", logits.dtype), ("NORMALIZE", routing.normalize), ("I", token_ids.dtype),
                    ("E", expert_table.dtype)]
    leading_shape = logits.shape[:-1]
    outputs = kernel(
        inputs=inputs,
        template=template,
        grid=(-(-tokens // WARPS_PER_BLOCK) * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        # (at least one shared column, so that no output of the kernel is empty)
        output_shapes=[(*leading_shape, routing.top_k)] * 2 + [(*leading_shape, max(routing.shared, 1))] * (section == "sigmoid_topk"),
        output_dtypes=[mx.uint32, weights_dtype] + [logits.dtype] * (section == "sigmoid_topk"),
    )
    if section != "sigmoid_topk":
        return tuple(outputs)
    return outputs[0], outputs[1], mx.repeat(outputs[2][..., : routing.shared], routing.shared_width, axis=-1)


_chosen: dict = {}  # (backend, switch, dtype, experts, routing) -> Implementation: one per layer kind


def moe_router(
    logits: mx.array, routing: Routing, correction_bias: Optional[mx.array] = None,
    global_scale: Optional[mx.array] = None, token_ids: Optional[mx.array] = None,
    expert_table: Optional[mx.array] = None,
) -> tuple:
    """Dispatcher: the moe_router implementation for the current backend and these logits
    (chosen once per backend, switch state and shape class: a decode step calls it per layer)."""
    key = (current_backend(), flag(CUDA_KERNEL_SWITCH), logits.dtype, logits.shape[-1], routing)
    implementation = _chosen.get(key)
    if implementation is None:
        implementation = _chosen[key] = moe_router_implementation(logits, routing)
    return implementation.function(logits, routing, correction_bias, global_scale, token_ids, expert_table)


def moe_router_implementation(logits: Optional[mx.array] = None, routing: Optional[Routing] = None) -> Implementation:
    return choose(
        "moe_router", moe_router_reference, moe_router_kernel, CUDA_KERNEL_SWITCH,
        None if logits is None else lambda: cuda_unsupported_reason(logits.dtype, logits.shape[-1], routing),
    )
