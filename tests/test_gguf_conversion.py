"""gguf_conversion: the float32 copy of a GGUF target, written one tensor at a time, holds exactly
what transformers' own GGUF loading gives (the route it replaced, which peaked at twice the
weights' memory)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moaspec import gguf_conversion
from moaspec.model_store import builtin_gguf_path, ensure_converted


@pytest.fixture(scope="module")
def smollm2_gguf():
    return builtin_gguf_path("smollm2-135m")


def test_chunked_dequantization_gives_the_values_of_one_call(smollm2_gguf, monkeypatch) -> None:
    """The embedding (Q8_0, 49,152 rows) de-quantized in chunks, the last one short, equals one
    whole call; a tensor with fewer rows than a chunk takes one call."""
    from gguf import GGUFReader, dequantize

    [embedding] = [t for t in GGUFReader(smollm2_gguf).tensors if t.name == "token_embd.weight"]
    monkeypatch.setattr(gguf_conversion, "DEQUANTIZE_ROWS", 5000)  # 49,152 = 9 x 5,000 + 4,152
    chunked = gguf_conversion._dequantized(embedding, dequantize)
    whole = dequantize(embedding.data, embedding.tensor_type)
    assert chunked.shape == whole.shape == (49152, 576) and np.array_equal(chunked, whole)
    calls = []
    monkeypatch.setattr(gguf_conversion, "DEQUANTIZE_ROWS", 60000)
    gguf_conversion._dequantized(embedding, lambda rows, kind: calls.append(len(rows)) or dequantize(rows, kind))
    assert calls == [49152]


def test_the_conversion_equals_transformers_own_gguf_loading(smollm2_gguf, tmp_path, monkeypatch) -> None:
    """The first use's conversion (a child process): every tensor bit for bit, and the config,
    generation config and tokenizer files byte for byte, against transformers'
    from_pretrained(gguf_file=...) saved as the conversion used to."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("MOASPEC_CACHE", str(tmp_path / "cache"))
    ours = ensure_converted(smollm2_gguf, "smollm2-135m")
    assert not list(ours.glob("*.raw"))
    loaded = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32)
    expected = loaded.state_dict()
    with safe_open(ours / gguf_conversion.SAFETENSORS_FILE, "pt") as written:
        names = set(written.keys())
        assert names == set(expected) - {"lm_head.weight"}  # tied to the embedding, not saved
        for name in names:
            assert torch.equal(written.get_tensor(name), expected[name]), name
    loaded.hf_quantizer = None
    if hasattr(loaded.config, "quantization_config"):
        del loaded.config.quantization_config
    theirs = tmp_path / "theirs"
    loaded.save_pretrained(theirs)
    for name in ("config.json", "generation_config.json"):
        assert json.loads((ours / name).read_text()) == json.loads((theirs / name).read_text()), name
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name).save_pretrained(theirs)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name


def test_a_gguf_that_cannot_be_converted_fails_in_one_line_in_a_process_free_of_transformers(tmp_path) -> None:
    """The conversion runs in a child process, so the process that decodes next (or a server)
    never holds transformers or the conversion's ~0.75 GB; a file the child cannot read is one
    line naming it, with the child's reason, and leaves nothing in the cache."""
    import subprocess
    import sys

    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(60))
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from moaspec.errors import MoaspecError\n"
        "from moaspec.model_store import ensure_converted\n"
        "try:\n"
        f"    ensure_converted(Path({str(broken)!r}), 'broken')\n"
        "except MoaspecError as exc:\n"
        "    print(exc)\n"
        "print('transformers' in sys.modules, 'torch' in sys.modules)\n"
    )
    env = {"MOASPEC_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    error, imported = done.stdout.splitlines()
    assert error.startswith("cannot convert target broken.gguf (a truncated, corrupt or unsupported GGUF file?): ")
    assert len(error) > len("cannot convert target broken.gguf (a truncated, corrupt or unsupported GGUF file?): ")
    assert imported == "False False"
    assert [p.name for p in (tmp_path / "cache" / "targets").iterdir()] == []


def test_conversion_shows_no_transformers_loading_or_saving_bars(tmp_path, monkeypatch, capsys) -> None:
    """transformers' own bars ("Loading weights", "Writing model shards": a line each on stderr)
    are off while converting, and back on after it, also after a failure."""
    from transformers.utils import logging as transformers_logging

    def converts(gguf, out_dir) -> None:
        for _ in transformers_logging.tqdm(range(3), desc="Loading weights"):
            pass

    monkeypatch.setattr(gguf_conversion, "_write_folder", converts)
    transformers_logging.enable_progress_bar()
    gguf_conversion.write_dequantized(tmp_path / "any.gguf", tmp_path)
    assert "Loading weights" not in capsys.readouterr().err
    assert transformers_logging.is_progress_bar_enabled()

    monkeypatch.setattr(gguf_conversion, "_write_folder", lambda gguf, out_dir: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        gguf_conversion.write_dequantized(tmp_path / "any.gguf", tmp_path)
    assert transformers_logging.is_progress_bar_enabled()
    for _ in transformers_logging.tqdm(range(3), desc="Loading weights"):  # the check can see a bar
        pass
    assert "Loading weights" in capsys.readouterr().err


def test_tensors_a_processor_puts_aside_are_written_too(smollm2_gguf, tmp_path, monkeypatch) -> None:
    """Some of transformers' tensor processors store a tensor themselves and skip it (GPT-2's
    output, MoE experts merged across tensors): those are written too, under their names. Here
    Llama's processor, made to put the final norm aside that way, gives the same file's tensors."""
    from safetensors import safe_open
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, GGUFTensor

    class PutsNormAside(TENSOR_PROCESSORS["llama"]):
        def process(self, weights, name, **kwargs):
            if name == "output_norm.weight":
                kwargs["parsed_parameters"]["tensors"]["model.norm.weight"] = torch.from_numpy(np.copy(weights))
                return GGUFTensor(weights, None, {})
            return super().process(weights, name, **kwargs)

    plain, aside = tmp_path / "plain", tmp_path / "aside"
    plain.mkdir()
    aside.mkdir()
    gguf_conversion.write_dequantized(smollm2_gguf, plain)
    monkeypatch.setitem(TENSOR_PROCESSORS, "llama", PutsNormAside)
    gguf_conversion.write_dequantized(smollm2_gguf, aside)
    with safe_open(plain / "model.safetensors", "pt") as a, safe_open(aside / "model.safetensors", "pt") as b:
        assert set(a.keys()) == set(b.keys()) and "model.norm.weight" in set(b.keys())
        assert all(torch.equal(a.get_tensor(name), b.get_tensor(name)) for name in a.keys())


@pytest.mark.parametrize("returncode, stdout, reason", [
    (-9, "", "the conversion process was killed (signal 9; out of memory?)"),
    (1, "a library's chatter\nunsupported architecture\n", "unsupported architecture"),
    (3, "", "the conversion ended with exit status 3"),
])
def test_a_failed_conversion_process_is_one_line_with_its_reason(tmp_path, monkeypatch, returncode, stdout, reason) -> None:
    """The child's last line is its reason (main prints it last); a child the system killed (the
    out-of-memory killer) is said to be killed, not a corrupt file's exit status."""
    import subprocess

    from moaspec import model_store
    from moaspec.errors import MoaspecError

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setenv("MOASPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(model_store.subprocess, "run",
                        lambda command, **kwargs: subprocess.CompletedProcess(command, returncode, stdout))
    with pytest.raises(MoaspecError) as failed:
        ensure_converted(gguf, "model")
    assert str(failed.value).endswith(f"GGUF file?): {reason}") and "\n" not in str(failed.value)
    assert [p.name for p in (tmp_path / "cache" / "targets").iterdir()] == []
