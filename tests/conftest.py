"""Root conftest: puts tests/ on sys.path so that `from optional_deps import require` works in every folder."""
