"""An OpenAI-compatible completions server with streaming (`specdec serve`)."""

from specdec.server.app import create_app

__all__ = ["create_app"]
