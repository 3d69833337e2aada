import io

import matplotlib.image as mpimg
import numpy as np

from eagle_pipeline.shared.figures import histogram_markdown, histogram_png


def test_histogram_is_a_real_non_blank_png():
    png = histogram_png({"prompt": np.arange(50), "output": np.arange(100, 400, 3)}, title="t", xlabel="tokens")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = mpimg.imread(io.BytesIO(png))
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.std() > 0.05


def test_histogram_of_nothing_still_renders():
    png = histogram_png({"a": np.array([])}, title="empty", xlabel="x")
    assert png[:4] == b"\x89PNG"


def test_markdown_embeds_the_png():
    md = histogram_markdown({"a": [1, 2, 2, 3]}, title="lengths", xlabel="x")
    assert md.startswith("![lengths](data:image/png;base64,")
