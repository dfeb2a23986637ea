# syntax=docker/dockerfile:1
# Multi-stage: build a wheel with the toolchain, install it into a slim runtime image
# that runs as an unprivileged user. No secret is baked in: provider keys come from the
# environment or from files (VENICE_API_KEY_FILE, ADMIN_TOKEN_FILE, ...) at run time.

FROM python:3.12-slim AS build
WORKDIR /src
RUN pip install --no-cache-dir --upgrade pip wheel
COPY pyproject.toml setup.cfg README.md LICENSE ./
COPY gateway ./gateway
COPY actors ./actors
COPY sql ./sql
COPY conf ./conf
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.12-slim AS runtime
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    BIND_ADDR=0.0.0.0:3000 \
    MANAGEMENT_BIND_ADDR=0.0.0.0:3001 \
    LLM_GATEWAY_HOME=/var/lib/llm-gateway
# The billing journal's directory exists (owned by the gateway user) so a volume mounted
# there starts with the right owner: compose keeps unshipped usage across re-creations.
RUN useradd --system --uid 10001 --home-dir /var/lib/llm-gateway --create-home gateway \
    && install -d -o gateway -g gateway /var/lib/llm-gateway/billing-journal
VOLUME ["/var/lib/llm-gateway/billing-journal"]
COPY --from=build /wheels /wheels
# The embedded PostgreSQL (pgserver) is for laptops; containers use DATABASE_URL.
RUN pip install --no-cache-dir /wheels/*.whl && pip uninstall -y pgserver && rm -rf /wheels
USER gateway
WORKDIR /var/lib/llm-gateway
EXPOSE 3000 3001
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:3000/healthz', timeout=2).status == 200 else 1)"
ENTRYPOINT ["llm-gateway"]
CMD ["serve", "--no-migrate"]
