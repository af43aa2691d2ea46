"""The `kvdb` command line (installed as the import package ``kvdb.cli``)."""
