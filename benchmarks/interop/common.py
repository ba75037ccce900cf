"""Inputs shared by the two sides of the interop checks (each side runs in its own environment)."""

SENTENCES = [
    "The cat sits on the mat.", "A dog plays in the park with a red ball.",
    "Quantized weights make large language models cheaper to serve.", "Paris is the capital of France.",
    "The stock market fell sharply on Monday morning.", "She plays the violin in an orchestra.",
    "Photosynthesis converts light into chemical energy.", "How do I reset my password?",
    "The train to Berlin leaves at seven.", "Rain is expected for most of the week.",
    "He fixed the bug by checking the array bounds.", "The museum opens a new exhibition of modern art.",
    "Coffee contains caffeine, a mild stimulant.", "Mountains cover a large part of Switzerland.",
    "The recipe needs two eggs and a cup of flour.", "A satellite orbits the earth every ninety minutes.",
]
PROMPT = "The capital of France is"
N_NEW = 24


def save_bpe_tokenizer(out) -> None:
    """A byte-level BPE tokenizer of 320 entries (<unk>, <s>, </s> first), as llama.cpp reads one, saved into the
    model directory `out` (tokenizers + transformers)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(out)


def llama_logits(path, tokens, out) -> None:
    """llama.cpp's logits at every position of `tokens` for the GGUF `path`, as JSON {"logits": ...} in `out`
    (llama-cpp-python)."""
    import json

    import numpy as np
    from llama_cpp import Llama

    m = Llama(model_path=str(path), n_ctx=256, verbose=False, n_threads=2, logits_all=True)
    m.eval(tokens)
    json.dump({"logits": np.array(m.scores[:len(tokens)]).tolist()}, open(out, "w"))
