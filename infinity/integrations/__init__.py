"""Integrations with Hugging Face Transformers and Accelerate. The core never imports them: these modules take
their objects duck-typed, and import transformers or accelerate only where a class must subclass theirs."""
