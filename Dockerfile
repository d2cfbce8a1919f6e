# The gateway's image: specgate and its runtime dependencies on a slim Python, run as a user
# without privileges. No vLLM (the pools run in images of their own); `specgate sim` is in it,
# for simulated pools. Build from the checkout's root:
#
#   docker build -t specgate:0.1.0 .
#   docker run --rm -p 8000:8000 specgate:0.1.0 serve --host 0.0.0.0     # the embedded default

FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY specgate ./specgate
COPY bench ./bench
COPY calibration ./calibration
COPY cli ./cli
COPY gateway ./gateway
COPY policies ./policies
COPY protocol ./protocol
COPY sim ./sim
COPY workers ./workers
RUN python -m venv /opt/specgate \
 && /opt/specgate/bin/pip install --no-cache-dir --disable-pip-version-check ".[kubernetes]"

FROM python:3.11-slim
COPY --from=build /opt/specgate /opt/specgate
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin specgate
ENV PATH=/opt/specgate/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 10001
EXPOSE 8000
ENTRYPOINT ["specgate"]
CMD ["serve", "--config", "/etc/specgate/gateway.toml"]
