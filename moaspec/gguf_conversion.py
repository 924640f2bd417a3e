"""A GGUF target written out as a float32 transformers folder (model_store.ensure_converted runs
`python -m moaspec.gguf_conversion GGUF OUT_DIR` in a child process), one tensor at a time.

transformers' own GGUF loading de-quantizes every tensor into one dictionary and then copies it
into a model, so converting SmolLM2-135M peaked at 1.2 GB of memory (twice the 540 MB of float32
weights; on the first run of a fresh machine). Here its parts are used one tensor at a time: the
config and tokenizer come from the GGUF's metadata as transformers reads them, the names from
its GGUF-to-transformers map (built on a weightless model), and each tensor is de-quantized and
put through transformers' tensor processor (e.g. Llama's query/key permutation undone), then
appended to a raw file; the safetensors file is its header (safetensors_header.py) followed by
that raw data. The tensors are those transformers' loading would give, bit for bit
(tests/test_gguf_conversion.py).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np

from moaspec.errors import first_line
from moaspec.safetensors_header import safetensors_header

SAFETENSORS_FILE = "model.safetensors"
COPY_CHUNK = 16 << 20  # bytes copied at a time from the raw tensors into the safetensors file
DEQUANTIZE_ROWS = 4096  # rows of a tensor de-quantized at a time (_dequantized)


def main(argv: list[str] | None = None) -> int:
    """`python -m moaspec.gguf_conversion GGUF OUT_DIR` (model_store runs it in a child process):
    0 once written; 1 with the reason in one line on stdout; 130 on an interrupt, silently (the
    parent, interrupted too, says so and removes the folder)."""
    gguf, out_dir = (Path(arg) for arg in (sys.argv[1:] if argv is None else argv))
    try:
        write_dequantized(gguf, out_dir)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a corrupt or unsupported file fails in many ways
        print(first_line(exc), flush=True)
        return 1
    return 0


def write_dequantized(gguf: Path, out_dir: Path) -> None:
    """Write `gguf` as a float32 transformers folder in `out_dir` (config, generation config,
    tokenizer, model.safetensors), with a progress bar over its tensors; transformers' own bars,
    a line each, are turned off meanwhile."""
    from transformers.utils import logging as transformers_logging

    bars_were_on = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        _write_folder(gguf, out_dir)
    finally:
        if bars_were_on:
            transformers_logging.enable_progress_bar()


def _write_folder(gguf: Path, out_dir: Path) -> None:
    """write_dequantized's work: the tensors first, then the config, generation config and tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with torch.device("meta"):  # names and shapes only, no weights
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    write_tensors(gguf, model, out_dir / SAFETENSORS_FILE)
    config.architectures = [type(model).__name__]
    config.dtype = torch.float32
    config.save_pretrained(out_dir)
    if model.can_generate():
        GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out_dir)


def write_tensors(gguf: Path, model, path: Path) -> None:
    """De-quantize `gguf`'s tensors one at a time into a float32 safetensors file at `path`, named
    as `model` (a weightless transformers model of the GGUF's architecture) names them."""
    from gguf import GGUFReader, dequantize
    from tqdm.auto import tqdm
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
        read_field,
    )

    parsed = load_gguf_checkpoint(str(gguf), return_tensors=False)
    parsed["tensors"] = {}  # where some processors put tensors themselves (GPT-2's output, MoE experts)
    reader = GGUFReader(gguf)
    architecture = read_field(reader, "general.architecture")[0]  # transformers' processor key
    reader.fields.clear()  # the metadata is read: its ~100k tokenizer entries (~0.1 GB) go; tensors keep theirs
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed["config"])
    names = get_gguf_hf_weights_map(model, processor)
    written: list[tuple[str, str, list[int], int]] = []
    raw = path.with_name(path.name + ".raw")
    with open(raw, "wb") as out:

        def append(name: str, weights) -> None:
            weights = np.ascontiguousarray(weights, dtype=np.float32)
            out.write(weights.data)
            written.append((name, "F32", list(weights.shape), weights.nbytes))

        for tensor in tqdm(reader.tensors, desc="Converting and de-quantizing GGUF tensors"):
            result = processor.process(
                weights=_dequantized(tensor, dequantize), name=tensor.name,
                tensor_key_mapping=names, parsed_parameters=parsed,
            )
            if result.name in names:
                append(names[result.name], result.weights)
        for name, tensor in parsed["tensors"].items():
            append(name, tensor.float().numpy())
    with open(path, "wb") as out, open(raw, "rb") as data:
        out.write(safetensors_header(written, {"format": "pt"}))
        shutil.copyfileobj(data, out, COPY_CHUNK)
    raw.unlink()


def _dequantized(tensor, dequantize) -> np.ndarray:
    """`tensor` (a GGUFReader tensor) de-quantized DEQUANTIZE_ROWS rows at a time into one array:
    de-quantizing a whole 49,152 x 576 embedding at once takes several times its 113 MB in
    temporaries. Blocks never span rows, so the values are those of one call."""
    rows = tensor.data  # quantized: (rows, bytes per row); float: the values
    if rows.ndim < 2 or len(rows) <= DEQUANTIZE_ROWS:
        return dequantize(rows, tensor.tensor_type)
    parts = (
        dequantize(rows[start:start + DEQUANTIZE_ROWS], tensor.tensor_type)
        for start in range(0, len(rows), DEQUANTIZE_ROWS)
    )
    first = next(parts)
    out = np.empty((len(rows), *first.shape[1:]), dtype=first.dtype)
    out[: len(first)] = first
    start = len(first)
    for part in parts:
        out[start:start + len(part)] = part
        start += len(part)
    return out


if __name__ == "__main__":
    sys.exit(main())
