"""ppserve's benchmarks, and the tools they and some tests use (model makers, peer set-up, the
perplexity evaluation, the timeline plot). One entry point, from the repository root:

    .venv/bin/python -m benchmarks NAME [ARGS...]     # e.g. serving --num-requests 64
    .venv/bin/python -m benchmarks --help             # the names, one line each

Each NAME is a module here (`serving` is benchmarks/serving.py, `make-moe-gguf` is
benchmarks/make_moe_gguf.py) with a `main(argv)`; each writes its results under
benchmarks/results/ through benchmarks/harness/record.py, and `tables` renders the
documentation's tables from them. Not part of the ppserve package: nothing here is installed.
"""
