"""Test helpers: a tiny real Hugging Face tokenizer and Llama checkpoint, built
locally (nothing is downloaded), for tests of user data and own-model runs.

:func:`save_tiny_hf_tokenizer` trains a byte-level BPE tokenizer on a few strings
(any text encodes, and decoding gives it back) with ``<s>`` (BOS, added to plain
text), ``</s>`` (EOS), ``<pad>`` and a ChatML chat template that opens with BOS;
:func:`save_tiny_hf_llama` writes a random Llama causal LM sized to it. Both are
deterministic: equal arguments write equal files.
"""

from __future__ import annotations

from pathlib import Path

CHATML_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The chat template :func:`save_tiny_hf_tokenizer` writes (ChatML, BOS first)."""

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")

_CORPUS = (
    "What is 12 + 7? The answer is 19.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May.",
    "system user assistant: Let's think step by step. #### 42",
    "Hello world, how are you today? Fine, thanks!",
)


def save_tiny_hf_tokenizer(directory: str | Path, *, chat_template: bool = True, pad_token: bool = True,
                           model_max_length: int = 256) -> Path:
    """Write a tiny byte-level BPE tokenizer (``transformers.PreTrainedTokenizerFast``).

    Args:
        directory: target directory (created if needed).
        chat_template: write :data:`CHATML_TEMPLATE` (else the tokenizer has none).
        pad_token: give it a ``<pad>`` token (else it has none, like Llama's).
        model_max_length: what the tokenizer files advertise.

    Returns:
        The directory; ``AutoTokenizer.from_pretrained(directory)`` loads it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, BOS, EOS, UNK, *CHAT_TOKENS]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(list(_CORPUS), trainer)
    bos_id = backend.token_to_id(BOS)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=BOS, eos_token=EOS, unk_token=UNK,
        pad_token=PAD if pad_token else None, additional_special_tokens=list(CHAT_TOKENS),
        chat_template=CHATML_TEMPLATE if chat_template else None, model_max_length=model_max_length,
        padding_side="left", clean_up_tokenization_spaces=False)
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(path)
    return path


def save_tiny_hf_llama(directory: str | Path, *, seed: int = 0, chat_template: bool = True,
                       max_position_embeddings: int = 256) -> Path:
    """Write a random tiny ``LlamaForCausalLM`` checkpoint with the tokenizer of
    :func:`save_tiny_hf_tokenizer` (vocabulary sized to it, its special-token ids).

    Args:
        directory: target directory (created if needed).
        seed: seed of the random weights (the global torch RNG is left untouched).
        chat_template: whether the tokenizer has a chat template.
        max_position_embeddings: the model's context length.

    Returns:
        The directory (``config.json``, ``model.safetensors``,
        ``generation_config.json`` and the tokenizer files).
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from workers.models import save_pretrained_here

    path = save_tiny_hf_tokenizer(directory, chat_template=chat_template,
                                  model_max_length=max_position_embeddings)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, dtype="float32")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
    save_pretrained_here(model, path)
    model.generation_config.save_pretrained(path)
    return path
