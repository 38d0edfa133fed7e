"""Generate with mlx-lm after mlx_moe_fix.apply().

    python examples/generate.py --model mlx-community/Qwen3-30B-A3B-4bit --prompt "Hello"

Needs a converted MLX model (a Hugging Face repo or a local path). Prints which path each MoE
layer kind took (kernel, reference or stock) after generating.
"""

import argparse

import mlx_moe_fix

mlx_moe_fix.apply()  # before or after importing mlx_lm: classes imported later are patched on import

from mlx_lm import generate, load  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--prompt", default="Explain mixture-of-experts in one paragraph.")
parser.add_argument("--max-tokens", type=int, default=128)
args = parser.parse_args()

model, tokenizer = load(args.model)
messages = [{"role": "user", "content": args.prompt}]
prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
print(generate(model, tokenizer, prompt=prompt, max_tokens=args.max_tokens, verbose=True))
for record, calls in sorted(mlx_moe_fix.path_counts().items()):
    print(f"{record.layer:24} {record.phase:8} {record.path:10} {calls:6} calls  ({record.reason})")
