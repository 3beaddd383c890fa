"""`python -m ikconvert`: the same application as the `ikconvert` command."""
from ikconvert.cli import app

app(prog_name="ikconvert")
