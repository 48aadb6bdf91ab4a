"""Label DP: the labels are released once through an epsilon-DP mechanism (release; RR with a
prior: rr_prior; ALIBI: alibi), then a network is trained on them (trainer; Ghazi et al.'s recipe: recipe)."""
