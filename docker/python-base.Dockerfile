# A Python base for the two images where no container registry is reachable: Debian's python3 on the
# Debian root file system that `shardwise kind build` makes with debootstrap (image shardwise/debian).
# It stands in for the public python:3.11-slim image, which the images use by default:
#   docker build -f docker/python-base.Dockerfile -t shardwise/python:3.11 docker/
#   docker build -f docker/operator.Dockerfile --build-arg BASE_IMAGE=shardwise/python:3.11 ...
ARG DEBIAN_IMAGE=shardwise/debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && ln -s /usr/bin/python3 /usr/local/bin/python
CMD ["python3"]
