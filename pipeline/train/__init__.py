"""Training the shapes model: a small AnimateDiff (UNetMotionModel, AutoencoderKL, CLIP text
encoder) that draws what a prompt of the shapes grammar asks (``pipeline.shapes``).

Stages run one after another (``stages.STAGES``): ``vae``, ``text``, ``teacher``; each resumes
from its checkpoint under a root folder kept outside the work tree. The caller passes the
project's prompt cleaning as ``clean`` (raw caption -> cleaned prompt), so the model trains on
the prompts exactly as the renderer sees them; this package imports nothing from ``jobs``.
"""
