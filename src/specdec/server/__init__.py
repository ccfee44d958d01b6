"""An OpenAI-compatible server with streaming, a scheduler and a live web view (`specdec serve`)."""

from specdec.server.app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]
