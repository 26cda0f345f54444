"""Serving: a continuous-batching engine over the latent cache and an OpenAI-compatible HTTP server.

runner (the one adapter to the model's inference step) -> engine (slots, queue, scheduler) ->
server (FastAPI). See docs/serving.md and `python -m experiments.serve`.
"""

from dsv3_jax import require_extra

require_extra("serve", "fastapi", "psutil", "uvicorn", "llguidance", needed_by="dsv3_jax.serving")

from dsv3_jax.serving.chat import ChatTemplateError, ChatTokenizer, tokenizer_file
from dsv3_jax.serving.engine import Engine, Event, QueueFull, Request, SamplingParams
from dsv3_jax.serving.runner import Runner
from dsv3_jax.serving.server import make_app

__all__ = ["ChatTemplateError", "ChatTokenizer", "Engine", "Event", "QueueFull", "Request", "Runner",
           "SamplingParams", "make_app", "tokenizer_file"]
