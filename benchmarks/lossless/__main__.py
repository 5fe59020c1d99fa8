"""``python -m benchmarks.lossless``: see :mod:`benchmarks.lossless.measure`."""

from .measure import main

if __name__ == "__main__":
    main()
