"""DCFL's Table I under central DP (src/fedcluster/reproduce.py ``dcfl-table1-central``,
docs/privacy.md): the settings it runs build the calibrated mechanism of
:mod:`fedcluster.privacy.central` on the ``dcfl-emnist-dynamic`` preset."""

from __future__ import annotations

import pytest

from fedcluster.config.schema import resolve_config
from fedcluster.errors import ConfigError
from fedcluster.privacy.central import CentralDP, calibrate_central, update_noise_multiplier
from fedcluster.reproduce import CENTRAL_COMMON, CENTRAL_MODES

N_CLIENTS = 25  # the preset's 20 clients and 5 newcomers


@pytest.mark.parametrize("mode", sorted(CENTRAL_MODES))
def test_table1_central_settings_build_the_calibrated_mechanism(mode: str) -> None:
    sets = [*CENTRAL_COMMON, *CENTRAL_MODES[mode]]
    config = resolve_config(None, "dcfl-emnist-dynamic", sets, {})
    central = CentralDP.from_config(config, N_CLIENTS, 50, seed=0)
    sketches = 1 if mode == "sketch" else 0
    # every client may release each of the 60 rounds, at full participation
    z, z_s, _ = calibrate_central(10.0, 1e-5, 1.0, 60, sketches, 0.5)
    assert central.noise_multiplier == pytest.approx(z)
    assert central.sketch_noise == pytest.approx(z_s)
    # Andrew et al. 2021, Theorem 1: z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2) with σ_b = 6
    assert central.update_noise == pytest.approx((z**-2 - 12.0**-2) ** -0.5)
    assert central.update_noise == pytest.approx(update_noise_multiplier(z, 6.0))


def test_table1_default_count_noise_is_too_small_for_25_clients() -> None:
    """σ_b = m/20 = 1.25 is below z/2 ≈ 2.05 at ε = 10 over 60 rounds: refused, which is
    why the benchmark sets σ_b = 6."""
    config = resolve_config(None, "dcfl-emnist-dynamic", CENTRAL_MODES["central"], {})
    with pytest.raises(ConfigError, match="count_noise"):
        CentralDP.from_config(config, N_CLIENTS, 50, seed=0)
