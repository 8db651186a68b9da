#!/usr/bin/env python3
"""Turn the Gemma 3 270M GGUF the llama.cpp benchmarks use into a folder vLLM loads.

vLLM 0.32 no longer reads GGUF itself (that moved to a plugin), so the same weights
the llama.cpp benchmarks serve are converted once, offline, with transformers:

- the Q4_K_M tensors are dequantised to bf16 safetensors (~540 MB);
- the tokenizer gets back the `<bos>` the GGUF's tokenizer leaves out: Gemma without
  it at the start of the prompt answers gibberish;
- a Gemma 3 chat template (system text folded into the first user turn, `model` for
  the assistant) and `<end_of_turn>` as a stop token beside `<eos>`, so a chat answer
  ends where the model ends its turn.

Run by `scripts/real_vllm.sh` (it skips the work when the folder is complete):

    python scripts/vllm_model.py GGUF_FILE OUT_DIR
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

#: Gemma 3's chat format, written for this folder (vLLM renders it with Jinja).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "<start_of_turn>{{ role }}\n"
    "{{ (first_user_prefix if loop.first else '') + (message['content'] | trim) }}"
    "<end_of_turn>\n"
    "{% endfor %}"
    "{%- if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
#: Written last: its presence says the folder is complete.
DONE_MARK = ".converted"


def convert(gguf_file: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # dequantize: plain dense tensors (transformers otherwise keeps GGUF blocks it cannot save).
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=name,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(gguf_file=name, dequantize=True),
    )
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    eos_ids = sorted({int(tokenizer.eos_token_id), int(end_of_turn)})
    tokenizer.add_bos_token = True
    tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    model.generation_config.eos_token_id = eos_ids
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    _ensure_bos_in_tokenizer_config(out_dir)
    _drop_quantization_config(out_dir)
    ids = tokenizer("Say hello.")["input_ids"]
    if not ids or ids[0] != tokenizer.bos_token_id:
        raise SystemExit(f"the converted tokenizer does not start a prompt with <bos>: {ids[:4]}")
    (out_dir / DONE_MARK).write_text(_mark(gguf_file))


def _ensure_bos_in_tokenizer_config(out_dir: Path) -> None:
    """vLLM reads `add_bos_token` from the saved config: make sure it says true."""
    path = out_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["add_bos_token"] = True
    config["chat_template"] = GEMMA3_CHAT_TEMPLATE
    path.write_text(json.dumps(config, indent=2) + "\n")


def _drop_quantization_config(out_dir: Path) -> None:
    """The weights are dense now: a leftover GGUF quantization entry would mislead vLLM."""
    path = out_dir / "config.json"
    config = json.loads(path.read_text())
    if config.pop("quantization_config", None) is not None:
        path.write_text(json.dumps(config, indent=2) + "\n")


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """transformers' progress bars and warnings say nothing a user of this script needs."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TQDM_DISABLE", "1")
    yield


def _mark(gguf_file: Path) -> str:
    """What the done mark says: the source and this conversion (a changed template redoes it)."""
    recipe = hashlib.sha256(GEMMA3_CHAT_TEMPLATE.encode()).hexdigest()[:16]
    return json.dumps({"from": gguf_file.name, "recipe": recipe}) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    gguf_file, out_dir = Path(argv[0]), Path(argv[1])
    mark = out_dir / DONE_MARK
    if mark.exists() and mark.read_text() == _mark(gguf_file):
        return 0
    print(
        f"converting {gguf_file.name} to a Hugging Face folder (about a minute) ...",
        file=sys.stderr,
    )
    with _quiet_progress():
        convert(gguf_file, out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
