import inspect
import json
import logging

import pytest
import torch

from vae_service.models import PRESETS, ModelLoadError, load_vae


def test_loads_decoder_only_from_a_saved_folder(kl_vae, kl_dir):
    loaded = load_vae(str(kl_dir))
    assert loaded.vae.encoder is None and loaded.vae.quant_conv is None
    full = kl_vae.state_dict()
    mine = loaded.vae.state_dict()
    assert set(mine) == {k for k in full if k.startswith(("decoder.", "post_quant_conv."))}
    assert all(torch.equal(mine[k], full[k]) for k in mine)
    encoder_params = sum(p.numel() for p in kl_vae.encoder.parameters()) + sum(
        p.numel() for p in kl_vae.quant_conv.parameters()
    )
    assert loaded.spec.skipped_params == encoder_params
    assert not loaded.spec.random_weights
    assert loaded.spec.normalisation.scaling == pytest.approx(0.18215) and loaded.spec.spatial_scale == 8


def test_loads_from_a_pipeline_folder_with_vae_subfolder(kl_vae, tmp_path):
    kl_vae.save_pretrained(tmp_path / "vae")
    (tmp_path / "model_index.json").write_text("{}")
    assert load_vae(str(tmp_path)).spec.class_name == "AutoencoderKL"


def test_loads_wan_decoder_only(wan_dir, wan_vae):
    loaded = load_vae(str(wan_dir))
    assert loaded.spec.family == "video" and loaded.spec.latent_channels == 4
    assert loaded.spec.normalisation.std == tuple(wan_vae.config.latents_std)
    assert loaded.vae.encoder is None


def test_missing_weights_names_the_problem(tmp_path, kl_vae):
    kl_vae.save_pretrained(tmp_path)
    (tmp_path / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no diffusion_pytorch_model"):
        load_vae(str(tmp_path))


def test_weights_not_matching_config(tmp_path, kl_vae):
    kl_vae.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["block_out_channels"] = [16, 32, 32, 64]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="do not match"):
        load_vae(str(tmp_path))


@pytest.mark.parametrize(
    "class_name, text",
    [
        ("UNet2DModel", "'UNet2DModel' is not a diffusers autoencoder with a decode method"),
        ("os.system", "is not a diffusers autoencoder"),
        ("ConsistencyDecoderVAE", "not served: decodes by sampling with random noise"),
    ],
)
def test_classes_that_do_not_decode_latents_to_pixels_are_refused(tmp_path, class_name, text):
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": class_name}))
    with pytest.raises(ModelLoadError, match=text):
        load_vae(str(tmp_path))


def test_unknown_source():
    with pytest.raises(ModelLoadError, match="neither a preset"):
        load_vae("not-a-model")


def test_hub_id_without_network_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match=r"could not fetch 'no-such-org/no-such-vae'.*local diffusers folder"):
        load_vae("no-such-org/no-such-vae")


@pytest.mark.parametrize("name", ["tiny-kl", "tiny-wan"])
def test_presets_are_seeded_and_loudly_random(name, caplog):
    with caplog.at_level(logging.WARNING):
        a, b = load_vae(name, seed=3), load_vae(name, seed=3)
    assert "SEEDED RANDOM WEIGHTS: it decodes noise" in caplog.text
    assert a.spec.random_weights
    sa, sb, sc = a.vae.state_dict(), b.vae.state_dict(), load_vae(name, seed=4).vae.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    assert all(torch.isfinite(v).all() for v in sa.values())


def test_full_size_preset_parameter_counts():
    """The decoder-only SD VAE keeps 49.5 M of its 83.7 M parameters (encoder never allocated)."""
    spec = load_vae("sd").spec
    assert spec.decoder_params == 49_490_199
    assert spec.skipped_params == 34_163_664
    assert {"sd", "sdxl", "flux", "flux2", "qwen-image", "wan2.1", "wan2.2", "hunyuan-video", "ltx-video"} < set(
        PRESETS
    )


def test_preset_latent_factors_are_the_ones_diffusers_pipelines_use():
    """Pipelines unscale with the VAE config's factors: SD's is diffusers' AutoencoderKL default,
    Wan2.1's per-channel statistics are AutoencoderKLWan's defaults; SDXL's and FLUX.1's come from
    their published VAE configs (stabilityai/sdxl-vae, black-forest-labs/FLUX.1-dev vae/)."""
    from diffusers import AutoencoderKL, AutoencoderKLWan

    default_scaling = inspect.signature(AutoencoderKL.__init__).parameters["scaling_factor"].default
    wan = inspect.signature(AutoencoderKLWan.__init__).parameters
    norm = {name: load_vae(name).spec.normalisation for name in ("sd", "sdxl", "flux", "wan2.1")}
    assert (norm["sd"].scaling, norm["sd"].shift) == (default_scaling, None) == (0.18215, None)
    assert (norm["sdxl"].scaling, norm["sdxl"].shift) == (0.13025, None)
    assert (norm["flux"].scaling, norm["flux"].shift) == (0.3611, 0.1159)
    assert norm["wan2.1"].kind == "mean_inv_std"
    assert norm["wan2.1"].mean == tuple(wan["latents_mean"].default)
    assert norm["wan2.1"].std == tuple(wan["latents_std"].default)


def test_pickled_bin_weights_are_refused(tmp_path, kl_vae):
    kl_vae.save_pretrained(tmp_path, safe_serialization=False)
    assert (tmp_path / "diffusion_pytorch_model.bin").is_file()
    with pytest.raises(ModelLoadError, match=r"pickled \.bin weights are not loaded"):
        load_vae(str(tmp_path))


def test_only_decoder_tensors_are_read_from_disk(kl_dir, kl_vae, monkeypatch):
    import safetensors

    read, original = [], safetensors.safe_open

    class Counting:
        def __init__(self, *args, **kwargs):
            self._file = original(*args, **kwargs)

        def __enter__(self):
            self._inner = self._file.__enter__()
            return self

        def __exit__(self, *exc):
            return self._file.__exit__(*exc)

        def keys(self):
            return self._inner.keys()

        def get_tensor(self, key):
            read.append(key)
            return self._inner.get_tensor(key)

    monkeypatch.setattr("vae_service.models.loading.safe_open", Counting)
    load_vae(str(kl_dir))
    on_disk = set(kl_vae.state_dict())
    wanted = {k for k in on_disk if k.startswith(("decoder.", "post_quant_conv."))}
    assert set(read) == wanted and len(read) == len(wanted) < len(on_disk)


# with the integration zoo's (tests/integration/test_model_zoo.py), every class the service names
@pytest.mark.parametrize(
    "name",
    ["mochi", "flux2", "ltx-video-timestep", "cosmos", "minimax-h3", "kvae-video", "hunyuan-video-1.5", "cogvideox",
     "sana", "hunyuan-video", "ltx-2"],
)  # fmt: skip
def test_a_loaded_folder_decodes_as_the_model_that_saved_it(tmp_path, name):
    """Decoder-only loading of any class: encoder-side modules never built, buffers the decoder
    reads (FLUX.2's BatchNorm statistics, LTX's latent statistics, Cosmos' and MiniMax's constant
    tables) intact, parameters flagged as diffusers flags them (matmul folds differently otherwise).
    The reference is diffusers' own `from_pretrained` of the same folder, never the in-memory model:
    safetensors-loaded weights are not 64-byte aligned, and on some CPUs (AMD EPYC) a kernel takes
    another path there, so the in-memory model differs from any load of its folder in the last bits."""
    import diffusers

    from tests.models import torch_threads
    from tests.zoo import BY_NAME, build, decode_alone, latents

    case = BY_NAME[name]
    vae = build(case, seed=5)
    vae.save_pretrained(tmp_path)
    loaded = load_vae(str(tmp_path))
    assert loaded.vae.encoder is None and loaded.spec.skipped_params > 0
    saved = vae.state_dict()
    assert all(torch.equal(tensor, saved[key]) for key, tensor in loaded.vae.state_dict().items())
    reference = getattr(diffusers, case.cls).from_pretrained(tmp_path, low_cpu_mem_usage=True).eval()
    z = latents(case, batch=2, seed=6)
    with torch_threads(1):
        assert torch.equal(decode_alone(loaded.vae, case, z), decode_alone(reference, case, z))


def test_a_class_whose_decode_reads_its_encoder_keeps_it(tmp_path, monkeypatch, kl_vae):
    """Where `decode` reaches into the encoder (as Qwen-Image's `vae.decode` counts its encoder's
    convs), dropping it would fail every request: the meta trace finds that at load and the encoder
    is loaded too. (A subclass injects the fault; the weights are a real saved AutoencoderKL.)"""
    import diffusers

    class EncoderCountingKL(diffusers.AutoencoderKL):
        def decode(self, z, *args, **kwargs):
            self._encoder_convs = sum(1 for _ in self.encoder.modules())
            return super().decode(z, *args, **kwargs)

    monkeypatch.setattr(diffusers, "EncoderCountingKL", EncoderCountingKL, raising=False)
    kl_vae.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "_class_name": "EncoderCountingKL"}))
    loaded = load_vae(str(tmp_path))
    assert loaded.vae.encoder is not None and loaded.spec.skipped_params == 0
    assert loaded.spec.path == "generic"
    z = torch.randn(1, 4, 3, 5)
    kl_vae = EncoderCountingKL.from_pretrained(tmp_path)  # the reference: diffusers' load of the folder
    with torch.inference_mode():
        assert torch.equal(loaded.vae.decode(z).sample, kl_vae.decode(z).sample)


# ---- what a hub id fetches (no network here: the selection, as huggingface_hub applies it) --------
PIPELINE_REPO = [
    "model_index.json", "README.md", "v1-5-pruned-emaonly.safetensors",  # a whole checkpoint at the root
    "unet/config.json", "unet/diffusion_pytorch_model.safetensors", "unet/diffusion_pytorch_model.fp16.safetensors",
    "text_encoder/config.json", "text_encoder/model.safetensors", "safety_checker/model.safetensors",
    "transformer/diffusion_pytorch_model.safetensors.index.json",
    "transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
    "vae/config.json", "vae/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.fp16.safetensors",
    "vae/diffusion_pytorch_model.bin", "scheduler/scheduler_config.json",
]  # fmt: skip


def fetched(files: list[str], variant: str = "fp32") -> list[str]:
    from huggingface_hub.utils import filter_repo_objects

    from vae_service.models.loading import hub_patterns

    return sorted(filter_repo_objects(files, allow_patterns=hub_patterns(variant)))


def test_a_pipeline_repo_fetches_only_its_vae():
    assert fetched(PIPELINE_REPO) == ["vae/config.json", "vae/diffusion_pytorch_model.safetensors"]
    fp16_only = [f for f in PIPELINE_REPO if f != "vae/diffusion_pytorch_model.safetensors"]
    assert fetched(fp16_only) == ["vae/config.json"]  # then the second pass, fp16 weights alone
    assert fetched(fp16_only, "fp16") == ["vae/config.json", "vae/diffusion_pytorch_model.fp16.safetensors"]


def test_a_vae_repo_fetches_its_config_and_weights_sharded_or_not():
    single = ["config.json", "diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin", "README.md"]
    assert fetched(single) == ["config.json", "diffusion_pytorch_model.safetensors"]
    sharded = [
        "config.json", "diffusion_pytorch_model.safetensors.index.json",
        "diffusion_pytorch_model-00001-of-00002.safetensors", "diffusion_pytorch_model-00002-of-00002.safetensors",
        "extra/diffusion_pytorch_model-00001-of-00002.safetensors",
    ]  # fmt: skip
    assert fetched(sharded) == sorted(sharded[:4])
