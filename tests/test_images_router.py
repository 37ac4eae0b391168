"""Images in requests, on the router's side: reading and checking them (router/images/), the
prompt the router counts and the chunks the shard gets, URL fetches and their guards."""

from __future__ import annotations

import base64
import http.server
import threading
import time

import pytest

from engine.batch import ImageInput
from engine.wire import convert
from router.http.openai_api import Message, message_text
from router.http.validation import Limits, Parameters, ValidationError, build_request
from router.images.decode import ImageError, ImageLimits, checked, data_url_bytes
from router.images.fetch import fetch_image
from router.images.prompt import ImagePolicy, policy_for
from tests.vision_models import image_bytes

LIMITS = Limits(max_input_tokens=200, max_total_tokens=256)


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def llava(tiny_llava_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llava_dir)
    return tokenizer, policy_for(tiny_llava_dir, tokenizer, ImageLimits(max_images=2))


def test_checked_images_name_their_problem():
    png = image_bytes(30, 20)
    image = checked(png, ImageLimits())
    assert (image.mimetype, image.width, image.height) == ("image/png", 30, 20)
    assert checked(image_bytes(8, 8, kind="JPEG"), ImageLimits()).mimetype == "image/jpeg"
    with pytest.raises(ImageError, match="corrupt"):
        checked(png[: len(png) // 2], ImageLimits())
    with pytest.raises(ImageError, match="corrupt or of an unknown format"):
        checked(b"not an image at all", ImageLimits())
    with pytest.raises(ImageError, match="format TIFF is not supported"):
        checked(image_bytes(8, 8, kind="TIFF"), ImageLimits())
    with pytest.raises(ImageError, match="30x20 = 600 pixels, more than the limit of 599"):
        checked(png, ImageLimits(max_pixels=599))
    with pytest.raises(ImageError, match="larger than 10 bytes"):
        checked(png, ImageLimits(max_bytes=10))
    with pytest.raises(ImageError, match="base64 data is corrupt"):
        data_url_bytes("data:image/png;base64,@@@", ImageLimits())
    with pytest.raises(ImageError, match="must read data:<type>;base64"):
        data_url_bytes("data:image/png,rawtext", ImageLimits())


def test_a_prompt_with_images_counts_each_as_its_image_tokens(llava):
    tokenizer, policy = llava
    first, second = image_bytes(30, 20, seed=1), image_bytes(50, 40, seed=2, kind="JPEG")
    text = f"look ![]({data_url(first)}) and ![a]({data_url(second, 'image/jpeg')}) now"
    request, ids = build_request(
        7, tokenizer, LIMITS, text, Parameters(max_new_tokens=4), images=policy
    )
    image_token = policy.spec.image_token_id
    assert ids.count(image_token) == 2 * 16
    assert [type(c) for c in request.chunks] == [str, ImageInput, str, ImageInput, str]
    assert request.chunks[1].data == first and request.chunks[3].mimetype == "image/jpeg"
    assert request.inputs.count("![](data:image/") == 2
    # the chunks travel in input_chunks, and come back from the wire as they went
    back = convert.request_from_pb(convert.request_to_pb(request))
    assert [c if isinstance(c, str) else c.data for c in back.chunks] == [
        c if isinstance(c, str) else c.data for c in request.chunks
    ]
    assert back.inputs == "look  and  now"  # a text model reads the text chunks alone
    plain, _ = build_request(
        8, tokenizer, LIMITS, "no images", Parameters(max_new_tokens=4), images=policy
    )
    assert (
        plain.chunks is None
        and convert.request_from_pb(convert.request_to_pb(plain)).chunks is None
    )


@pytest.mark.parametrize(
    "url, problem",
    [
        ("data:image/png;base64,iVBORw0KGgo=", "corrupt"),
        ("https://example.com/cat.png", "image URLs are not allowed"),
    ],
)
def test_bad_images_are_validation_errors(llava, url, problem):
    tokenizer, policy = llava
    with pytest.raises(ValidationError, match=problem):
        build_request(
            1, tokenizer, LIMITS, f"![]({url})", Parameters(max_new_tokens=4), images=policy
        )


def test_too_many_images_and_truncation_through_images_are_refused(llava):
    tokenizer, policy = llava
    image = f"![]({data_url(image_bytes(8, 8))})"
    with pytest.raises(ValidationError, match="up to 2 images. Given: 3"):
        build_request(1, tokenizer, LIMITS, image * 3, Parameters(max_new_tokens=4), images=policy)
    with pytest.raises(ValidationError, match="`truncate` would cut the prompt's images"):
        build_request(
            1, tokenizer, LIMITS, image, Parameters(max_new_tokens=4, truncate=5), images=policy
        )


def test_openai_image_parts_are_refused_by_a_text_model_and_read_by_a_vlm(llava):
    parts = [
        {"type": "text", "text": "what is "},
        {"type": "image_url", "image_url": {"url": "data:x"}},
    ]
    message = Message(role="user", content=parts)
    with pytest.raises(ValidationError, match="this model does not take images"):
        message_text(message, ImagePolicy(None))
    with pytest.raises(ValidationError, match="this model does not take images"):
        message_text(message, None)
    assert message_text(message, llava[1]) == "what is ![](data:x)"
    # a text model reads TGI's markdown as text, as TGI's text models do
    tokenizer, _ = llava
    request, _ = build_request(
        2,
        tokenizer,
        LIMITS,
        "![](data:image/png;base64,AA)",
        Parameters(max_new_tokens=4),
        images=ImagePolicy(None),
    )
    assert request.chunks is None


class Handler(http.server.BaseHTTPRequestHandler):
    png = image_bytes(16, 16)

    def do_GET(self):  # noqa: N802 - http.server's name
        routes = {
            "/cat.png": (200, {}, self.png),
            "/to-private": (302, {"Location": "http://10.1.2.3/cat.png"}, b""),
            "/to-loopback": (302, {"Location": "http://127.0.0.1:1/cat.png"}, b""),
            "/to-cat": (302, {"Location": "/cat.png"}, b""),
            "/loop": (302, {"Location": "/loop"}, b""),
        }
        if self.path == "/slow":
            time.sleep(1.5)
        status, headers, body = routes.get(self.path, (404, {}, b""))
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_url_fetches_follow_only_public_redirects(image_server):
    port = image_server
    # The test's own server is the one loopback address admitted: every hop is checked with it.
    only_ours = lambda address, p: (address, p) == ("127.0.0.1", port)  # noqa: E731
    base, limits = f"http://127.0.0.1:{port}", ImageLimits(allow_urls=True, url_timeout=1.0)
    assert fetch_image(f"{base}/cat.png", limits, only_ours) == Handler.png
    assert fetch_image(f"{base}/to-cat", limits, only_ours) == Handler.png
    with pytest.raises(ImageError, match=r"'10.1.2.3' is a private or local address"):
        fetch_image(f"{base}/to-private", limits, only_ours)
    with pytest.raises(ImageError, match=r"'127.0.0.1' is a private or local address"):
        fetch_image(f"{base}/to-loopback", limits, only_ours)
    with pytest.raises(ImageError, match="redirects more than 3 times"):
        fetch_image(f"{base}/loop", limits, only_ours)
    with pytest.raises(ImageError, match="answered HTTP 404"):
        fetch_image(f"{base}/missing", limits, only_ours)
    with pytest.raises(ImageError, match="larger than 100 bytes"):
        fetch_image(f"{base}/cat.png", ImageLimits(allow_urls=True, max_bytes=100), only_ours)
    with pytest.raises(ImageError, match="did not answer within 1.0 seconds"):
        fetch_image(f"{base}/slow", limits, only_ours)
    # without the test's exception, the loopback server itself is refused
    with pytest.raises(ImageError, match="private or local address"):
        fetch_image(f"{base}/cat.png", limits)
    with pytest.raises(ImageError, match="must be data:, http: or https:"):
        fetch_image("ftp://example.com/x.png", limits)
