"""The default sampling fields of an engine: what a request that leaves temperature, top_p, top_k, min_p or
repetition_penalty out gets (the server and tinyserve.LLM apply them; an explicit field always wins).

Resolved once at start-up, in layers, each over the one before:
1. the neutral values (SamplingDefaults' own: OpenAI's, vLLM's `--generation-config vllm`);
2. with generation_config "auto", the checkpoint's: a Hugging Face folder's generation_config.json (as vLLM's
   `--generation-config auto`), or for a GGUF llama.cpp's defaults and over them the file's
   general.sampling.* metadata (as llama.cpp), or where it has none its alias's model-card values
   (loader/model_loader.py ALIAS_SAMPLING);
3. override_generation_config, field by field.
The result is checked by SamplingParams (the ranges' one source), so a bad file or flag stops the start-up
with the field named, never a request.
"""

from __future__ import annotations

import logging

from tinyserve.config import LLAMA_CPP_SAMPLING_DEFAULTS, EngineConfig, SamplingDefaults
from tinyserve.loader.model_loader import LoadedModel
from tinyserve.types import InvalidRequest, SamplingParams

logger = logging.getLogger(__name__)


def resolve_sampling_defaults(config: EngineConfig, loaded: LoadedModel) -> SamplingDefaults:
    """The engine's defaults; raises ValueError naming the field and where its value came from."""
    fields: dict[str, float | int | None] = {}
    sources = ["neutral"]
    if config.generation_config == "auto" and loaded.is_hf_folder:
        fields.update(loaded.recommended_sampling)
        sources[0] = "generation_config.json" if loaded.recommended_sampling else "neutral (no generation_config)"
    elif config.generation_config == "auto":
        fields.update(LLAMA_CPP_SAMPLING_DEFAULTS)
        fields.update(loaded.recommended_sampling)
        sources[0] = "llama.cpp defaults" + (" + the model's recommended values" if loaded.recommended_sampling else "")
    if config.override_generation_config:
        fields.update(config.override_generation_config)
        sources.append("--override-generation-config")
    if fields.get("top_k") in (-1, 0):  # HF's, vLLM's and llama.cpp's spellings of "no top-k cut"
        fields["top_k"] = None
    source = " + ".join(sources)
    try:
        SamplingParams(**fields)
    except InvalidRequest as exc:
        raise ValueError(f"default sampling parameters ({source}): {exc}") from None
    defaults = SamplingDefaults(**fields)
    logger.info("default sampling parameters (%s): %s", source, defaults.as_fields())
    return defaults
