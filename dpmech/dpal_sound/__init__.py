"""A sound DPAL: DP-SGD on DPAL's adversarial objective (Eq. 10), certified at test time by randomized
smoothing (Cohen et al. 2019) (trainer). Decisions: docs/dpal_sound.md."""
