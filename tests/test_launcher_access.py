"""The launcher passes the router's access, tracing and payload flags on; the API key only in the environment."""

from launcher.cli import build_parser, config_from_args
from router.app import build_parser as router_parser
from router.http.access import access_from_args
from router.http.errors import DEFAULT_PAYLOAD_LIMIT


def launched(*argv):
    return config_from_args(build_parser().parse_args(list(argv)))


def test_access_and_tracing_flags_reach_the_router_and_the_key_stays_off_its_command_line():
    config = launched(
        "--api-key",
        "sk-secret",
        "--cors-allow-origin",
        "https://a.example",
        "--otlp-endpoint",
        "http://collector:4317",
    )
    args = config.router_args()
    assert "sk-secret" not in " ".join(args)
    assert config.router_environment({"PATH": "/bin"})["BUCKETSERVE_API_KEY"] == "sk-secret"
    parsed = router_parser().parse_args(args)
    assert parsed.otlp_endpoint == "http://collector:4317"
    assert access_from_args(parsed).cors_allow_origins == ("https://a.example",)


def test_no_flags_no_key_no_tracing(monkeypatch):
    monkeypatch.delenv("BUCKETSERVE_API_KEY", raising=False)
    config = launched()
    assert "BUCKETSERVE_API_KEY" not in config.router_environment({})
    parsed = router_parser().parse_args(config.router_args())
    assert parsed.otlp_endpoint is None and access_from_args(parsed).api_key is None


def test_the_router_reads_its_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("BUCKETSERVE_API_KEY", "from-env")
    parsed = router_parser().parse_args(["--master-shard-uds-path", "unix:///tmp/x-0"])
    assert access_from_args(parsed).api_key == "from-env"


def test_the_payload_limit_reaches_the_router_with_tgis_default():
    assert (
        router_parser().parse_args(launched().router_args()).payload_limit
        == DEFAULT_PAYLOAD_LIMIT
        == 2_000_000
    )
    assert (
        router_parser().parse_args(launched("--payload-limit", "1000").router_args()).payload_limit
        == 1000
    )
