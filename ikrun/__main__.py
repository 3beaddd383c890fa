"""`python -m ikrun`: the same application as the `ikrun` command."""
from ikrun.cli import app

app(prog_name="ikrun")
