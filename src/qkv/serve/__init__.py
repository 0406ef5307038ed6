"""``qkv serve``: trained models behind an HTTP API (FastAPI + uvicorn), with the attention explorer.

* :mod:`qkv.serve.models`: the served models, opened by kind (translation, language model, encoder);
* :mod:`qkv.serve.batching`: the one model thread and the dynamic batcher of translation requests;
* :mod:`qkv.serve.streaming`: a language model's tokens as server-sent events;
* :mod:`qkv.serve.app`: the FastAPI application, its routes and its JSON errors;
* :mod:`qkv.serve.server`: the app on a uvicorn server (what ``qkv serve`` runs).

Importing this package needs nothing beyond qkv; its modules need ``pip install 'qkv[serve]'``.
"""

INSTALL_HINT = "qkv serve needs FastAPI and uvicorn: pip install 'qkv[serve]'"


def check_installed() -> None:
    """Raise a one-line ``ValueError`` naming the extra to install when FastAPI or uvicorn is missing."""
    import importlib.util

    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"{INSTALL_HINT} ({' and '.join(missing)} not installed)")
