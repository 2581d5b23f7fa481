"""``python -m models train ...``: serial training (see :mod:`models.train`)."""

from runner.errors import main_guard

from .train import main

if __name__ == "__main__":
    main_guard(main)()
