"""AdLM: the Adaptive Laplace Mechanism (Phan, Wu, Hu & Dou, "Adaptive Laplace Mechanism: Differential
Privacy Preservation in Deep Learning", ICDM 2017, arXiv 1709.05750; reference code lineage
haiphanNJIT/PrivateDeepLearning). Decisions: docs/adlm.md.

* ``budget``     the split eps_1 + eps_2 + eps_3, the sensitivities, the relevance-adaptive redistribution
                 of eps_2 over the input features and its Laplace scales (Alg. 1 lines 1-19, the Theorem)
* ``relevance``  LRP-epsilon, per-example normalisation, the average relevance R(D) (Alg. 1 lines 1-7)
* ``config``     ``AdLMConfig``
* ``trainer``    ``AdLMTrainer`` (noise drawn once; the Taylor loss and network of ``dpmech.dpal``), resumable
"""

from dpmech.adlm.budget import (AdLMBudget, feature_copies, feature_scales, feature_sensitivity, features_epsilon,
                                loss_sensitivity, redistribute, relevance_sensitivity, split_budget)
from dpmech.adlm.config import AdLMConfig
from dpmech.adlm.relevance import (RelevanceNet, average_relevance, lrp_epsilon, normalized_relevance,
                                   train_relevance_net)
from dpmech.adlm.trainer import AdLMClassifier, AdLMTrainer

__all__ = [
    "AdLMBudget", "feature_copies", "feature_scales", "feature_sensitivity", "features_epsilon", "loss_sensitivity",
    "redistribute", "relevance_sensitivity", "split_budget", "AdLMConfig", "RelevanceNet", "average_relevance",
    "lrp_epsilon", "normalized_relevance", "train_relevance_net", "AdLMClassifier", "AdLMTrainer",
]
