"""Plausible wrong versions of the minillm/quantize.py exercise region: the grade must catch each of them on every draw.

Instructor only: `make` leaves every wrong_*.py out of a copy (copies.INSTRUCTOR_ONLY), since a wrong
version is one step from a right one. tests/test_exercise_catalogue.py splices each into the reference
module, grades it on 200 seeds of held-out inputs, and requires less than full marks on every seed.
Each entry is the region's code, unindented. (Clamping to [-128, 127] with the right scale is no mistake
the grade can see: W / scale never leaves [-127, 127], so the clamp never acts; the range is judged where a
wrong scale would push q past it.)
"""

WRONG = {
    "quantize-per-channel": {
        "one scale for the whole tensor, not one per row": """
scales = (w.abs().max() / 127).expand(w.shape[0]).clone()
scales = torch.where(scales > 0, scales, torch.ones_like(scales))
q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
""",
        "rounds toward zero: the cast to int8 truncates": """
scales = w.abs().amax(dim=1) / 127
scales = torch.where(scales > 0, scales, torch.ones_like(scales))
q = (w / scales[:, None]).clamp(-127, 127).to(torch.int8)
""",
        "forgets the row of zeros: its scale is 0 and 0 / 0 is NaN": """
scales = w.abs().amax(dim=1) / 127
q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
""",
        "uses int8's whole range: scale over 128, clamped to [-128, 127]": """
scales = w.abs().amax(dim=1) / 128
scales = torch.where(scales > 0, scales, torch.ones_like(scales))
q = torch.round(w / scales[:, None]).clamp(-128, 127).to(torch.int8)
""",
        "takes the row's largest weight, not its largest magnitude": """
scales = w.amax(dim=1) / 127
scales = torch.where(scales > 0, scales, torch.ones_like(scales))
q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
""",
        "rounds down": """
scales = w.abs().amax(dim=1) / 127
scales = torch.where(scales > 0, scales, torch.ones_like(scales))
q = torch.floor(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
""",
        "one scale per column (input channel), not per row": """
scales = w.abs().amax(dim=0) / 127
scales = torch.where(scales > 0, scales, torch.ones_like(scales))
q = torch.round(w / scales[None, :]).clamp(-127, 127).to(torch.int8)
""",
        "does not clamp, and takes the scale over 128": """
scales = w.abs().amax(dim=1) / 128
scales = torch.where(scales > 0, scales, torch.ones_like(scales))
q = torch.round(w / scales[:, None]).to(torch.int8)
""",
    },
}
