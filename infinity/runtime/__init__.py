"""DeepSpeed's module paths that scripts reach through ``deepspeed.runtime`` (with ``import infinity as
deepspeed``), each re-exporting what infinity implements elsewhere; nothing lives here."""

from infinity.runtime import zero

__all__ = ["zero"]
