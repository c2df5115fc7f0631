"""`exl serve`: an OpenAI-compatible HTTP server on top of the dynamic generator (see docs/server.md).

    from exl.server import create_app, load_config
"""

from exl.server.app import create_app
from exl.server.config import ServerConfig, load_config

__all__ = ["create_app", "load_config", "ServerConfig"]
