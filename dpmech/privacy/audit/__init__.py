"""Empirical privacy audits in one run: Steinke et al.'s bound (one_run), Mahloujifar et al.'s f-DP
bound (fdp), the GDP estimate (gdp), all of them at once (estimators), white-box canaries (whitebox)."""
