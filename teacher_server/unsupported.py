"""The error a checkpoint that is not built is refused with (by name, at start-up): raised
where config.json is read (``models``) and where a weight format is chosen (``layers.formats``)."""

from __future__ import annotations


class UnsupportedModelError(ValueError):
    """A config.json (architecture, setting or weight format) that is not built, named."""
