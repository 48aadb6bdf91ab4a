"""DP-MERF (Harder et al., AISTATS 2021): one noisy release of the data's random-feature mean embedding,
then a generator trained to match it (trainer). Decisions: docs/dp_merf.md."""
