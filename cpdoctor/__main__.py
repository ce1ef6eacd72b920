"""`python -m cpdoctor` is the same as the `cpdoctor` console script."""

from cpdoctor.cli import main

if __name__ == "__main__":
    main()
