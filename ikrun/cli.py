"""`ikrun`: evaluate GGUF models with ik_llama.cpp's numerics: logits, perplexity, KL-divergence, validation.

Each command lives in ikrun/commands/; this module only wires them into one application."""

from ikquant.cli_common import new_app
from ikrun.commands.accept import accept
from ikrun.commands.evaluate import kld, logits, ppl
from ikrun.commands.imatrix import imatrix
from ikrun.commands.mix import mix
from ikrun.commands.sweep import sweep
from ikrun.commands.validate import validate

app = new_app(__doc__, "Evaluate GGUF models: logits, perplexity, KL-divergence against a base, validation against HF.",
              ordinary_pages=True)
for command in (logits, ppl, kld, imatrix, sweep, mix, accept, validate):
    app.command()(command)
