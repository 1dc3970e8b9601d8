"""Model execution: configs, the Llama-family model, weights, KV cache, sampling, tokenizer glue."""
