"""How a decoded clip's frames split over its latent frames: streams, previews and encoders cut
at the same places."""


def frame_counts(total: int, latent_frames: int, law: tuple[int, int] | None) -> list[int]:
    """How many output frames each latent frame stands for: the decoder's own law where it has one
    (Wan: 1, then 4 each), else the frames spread evenly with the remainder at the end."""
    if latent_frames == 1:
        return [total]
    if law is not None:
        a, b = law
        return [a + b] + [a] * (latent_frames - 1)
    base, extra = divmod(total, latent_frames)
    return [base] * (latent_frames - extra) + [base + 1] * extra
