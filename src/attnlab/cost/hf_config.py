"""The config.json reader moved to ``attnlab.hf_config`` (one reader for cost, hf and bench); this module keeps the
old import path working."""

from ..hf_config import from_hf_config

__all__ = ["from_hf_config"]
