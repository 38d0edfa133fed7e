"""Session 33 (docs/benchmarks.md, thirty-third session, item 4): a bound, not a design: the MoE
model's decoder layers without their last residual add (each returns its MoE block's output, so
its tokens are not the model's), as one more variant of benchmarks/decode_timeline's bursts, against
the patched model and the dense equivalent: what one node fewer a layer is worth at batch 1.
    source .mlx-cuda/setup.sh && python3 docs/experiments/no_residual_add_bound.py --model qwen3_moe --cycles 16 --block-variant no-add"""
from benchmarks import decode_timeline as T

def decoder_classes(model):
    return {type(m) for _, m in model.named_modules() if hasattr(getattr(m, "mlp", None), "switch_mlp")
            or hasattr(getattr(m, "block_sparse_moe", None), "switch_mlp")}

original = T.block_variant
def block_variant(variant, model_name, built):
    if variant != "no-add":
        return original(variant, model_name, built)
    def make(own):
        def no_add(self, x, mask=None, cache=None):
            r = self.self_attn(self.input_layernorm(x), mask, cache)
            h = x + r
            moe = self.mlp if hasattr(self, "mlp") else self.block_sparse_moe
            return moe(self.post_attention_layernorm(h))
        return no_add
    return False, decoder_classes(built[False]), make
T.block_variant = block_variant
T.BLOCK_VARIANTS = T.BLOCK_VARIANTS + ("no-add",)
T.main()
