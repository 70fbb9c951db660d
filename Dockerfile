# CPU image. For GPU replicas start from a CUDA PyTorch image and drop the TORCH_SPEC pin.
FROM python:3.11-slim
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"
WORKDIR /app
RUN pip install --no-cache-dir --index-url ${TORCH_INDEX} "${TORCH_SPEC}"
COPY pyproject.toml README.md ./
COPY vae_service ./vae_service
COPY clients ./clients
COPY deploy ./deploy
RUN pip install --no-cache-dir ./clients .
EXPOSE 8000 9000
# Mount a local diffusers VAE folder and pass --model /models/vae for real weights;
# the default preset has seeded random weights and decodes noise.
CMD ["vae-service", "serve", "--host", "0.0.0.0", "--port", "8000"]
