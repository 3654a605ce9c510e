S=${S:-/root/stage}
W=${W:-/root/work}
export PATH=$S/bin:$PATH PYTHONPATH=$S/site:$S/pkgs:$W/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
