"""Training the shapes model: a small AnimateDiff (UNetMotionModel, AutoencoderKL, CLIP text
encoder) that draws what a prompt of the shapes grammar asks (``pipeline.shapes``).

Stages run one after another (``recipe.run_all``): ``vae``, ``text``, ``teacher`` (``stages``),
then ``student``, the LCM step distillation for the 6- and 8-step tiers (``distill``); each
resumes from its checkpoint under a root folder kept outside the work tree. ``export`` writes
the built-in ``shapes`` model folder from the checkpoints. The caller passes the project's
prompt cleaning as ``clean`` (raw caption -> cleaned prompt), so the model trains on the prompts
exactly as the renderer sees them; this package imports nothing from ``jobs`` (``clipmill
train-model`` in ``jobs/cli/train.py`` is the entry point).
"""
