"""llama.cpp's C API (through llama-cpp-python) as the golden script and the engine benchmark
use it: one sequence in a fresh context with our fixed settings (flash attention off, F16 KV
cache), tokens decoded in batches, logits of the last one read back."""

import contextlib

import numpy as np

import llama_cpp


def context_params(n_ctx, n_batch, n_threads, perf=False):
    p = llama_cpp.llama_context_default_params()
    p.n_ctx = n_ctx
    p.n_batch = n_batch
    p.n_ubatch = n_batch
    p.n_seq_max = 1
    p.n_threads = n_threads
    p.n_threads_batch = n_threads
    p.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    p.type_k = llama_cpp.GGML_TYPE_F16
    p.type_v = llama_cpp.GGML_TYPE_F16
    p.no_perf = not perf   # llama.cpp leaves its timing counters off unless asked
    return p


@contextlib.contextmanager
def fresh_context(model, n_ctx, n_batch, n_threads, perf=False):
    """Yields (ctx, batch) for one sequence; frees both afterwards."""
    ctx = llama_cpp.llama_init_from_model(model, context_params(n_ctx, n_batch, n_threads, perf))
    if not ctx:
        raise RuntimeError("llama_init_from_model failed")
    batch = llama_cpp.llama_batch_init(max(n_batch, 1), 0, 1)
    try:
        yield ctx, batch
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)


def decode(ctx, batch, tokens, n_past):
    """Decodes tokens at positions n_past.., asking for logits of the last one only."""
    assert len(tokens) > 0
    batch.n_tokens = len(tokens)
    for i, t in enumerate(tokens):
        batch.token[i] = t
        batch.pos[i] = n_past + i
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = i == len(tokens) - 1
    rc = llama_cpp.llama_decode(ctx, batch)
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc}")


def last_logits(ctx, n_vocab):
    """The last decoded token's logits (reading them waits for the computation to finish)."""
    ptr = llama_cpp.llama_get_logits_ith(ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(n_vocab,)).copy()


def n_vocab_of(model):
    return llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
