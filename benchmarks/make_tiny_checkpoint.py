"""Write a small random Hugging Face checkpoint (weights, config, tokenizer, chat template).

The command line of ppserve.engine.model.tiny_checkpoint.make_tiny_checkpoint (which code calls
directly, with a TinySpec); the peers' set-up writes its shapes' checkpoints through it.

    python -m benchmarks make-tiny-checkpoint --out /tmp/tiny --arch qwen3 --layers 4
"""

from __future__ import annotations

import argparse

from ppserve.engine.model.tiny_checkpoint import ARCHITECTURES, TinySpec, make_tiny_checkpoint


def main(argv: list[str] | None = None) -> None:
    d = TinySpec()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--arch", default=d.arch, choices=sorted(ARCHITECTURES))
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--layers", type=int, default=d.num_layers)
    p.add_argument("--heads", type=int, default=d.num_heads)
    p.add_argument("--kv-heads", type=int, default=d.num_kv_heads)
    p.add_argument("--head-dim", type=int, default=None, help="default: hidden-size / heads")
    p.add_argument("--intermediate-size", type=int, default=d.intermediate_size)
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument("--max-position-embeddings", type=int, default=d.max_position_embeddings)
    p.add_argument("--tie", action="store_true", help="tie lm_head to the embedding")
    p.add_argument("--rope-scaling", default=d.rope_scaling, choices=["none", "linear", "llama3"])
    p.add_argument("--sliding-window", type=int, default=None, help="mistral only")
    p.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-shard-size", default=None, help="e.g. 200KB: write a sharded checkpoint")
    p.add_argument("--init-std", type=float, default=d.init_std)
    p.add_argument("--seed", type=int, default=d.seed)
    a = p.parse_args(argv)
    spec = TinySpec(
        arch=a.arch,
        hidden_size=a.hidden_size,
        num_layers=a.layers,
        num_heads=a.heads,
        num_kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        intermediate_size=a.intermediate_size,
        vocab_size=a.vocab_size,
        max_position_embeddings=a.max_position_embeddings,
        tie_word_embeddings=a.tie,
        rope_scaling=a.rope_scaling,
        sliding_window=a.sliding_window,
        dtype=a.dtype,
        max_shard_size=a.max_shard_size,
        init_std=a.init_std,
        seed=a.seed,
    )
    print(make_tiny_checkpoint(a.out, spec))
