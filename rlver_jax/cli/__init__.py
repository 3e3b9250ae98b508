"""What the command-line entry points share: flag parsing with config errors as one line (`flags`),
how they end on an error (`errors`) and the quiet console (`console`).

May import only the standard library, absl and ml_collections: every entry point loads it first.
"""
