"""Integrations with existing TTS packages (import the submodule you need; each pulls in its package)."""
