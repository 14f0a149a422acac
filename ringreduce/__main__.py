"""`python -m ringreduce ARGS` is `ringrun ARGS`: the same launcher, arguments and exit code.

    python -m ringreduce -np 4 python train.py
"""
import sys

from .launch.ringrun import main

if __name__ == "__main__":
    sys.exit(main())
