"""The model: what one stage computes, with no notion of processes or plans.

Model definitions (the Llama family), attention and the CPU decode kernel, linears, weights
(Hugging Face safetensors and GGUF), the KV cache's layout, sampling and the tokenizer.

May import: `ppserve.scheduler` (sampling constants) and its own modules. Never the runtime,
the cluster, disaggregation or the server: a model runs the same in a test, a stage process or
a notebook.
"""
