"""`python -m ikquant`: the same application as the `ikquant` command."""
from ikquant.cli import app

app(prog_name="ikquant")
