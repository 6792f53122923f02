"""Upload a timm-affinediv Hub folder (written by save_hub_folder) to the Hugging Face Hub.

    timm-affinediv push runs/resnet18-patchnorm --repo-id my-org/resnet18-patchnorm --dry-run

The token comes from --token, else HF_TOKEN or the saved login (`hf auth login`); it is never
printed. HF_ENDPOINT selects another Hub endpoint.
"""
import sys

from timm_affinediv.cli import existing_dir, run_main
from timm_affinediv.commands import command_parser
from timm_affinediv.hub import push_to_hub


def main(argv: list[str] | None = None) -> int:
    parser = command_parser('push', __doc__)
    parser.add_argument('folder', type=existing_dir, help='Hub folder: model.safetensors, config.json, README.md')
    parser.add_argument('--repo-id', required=True, help="target repo, 'org/name'")
    parser.add_argument('--private', action='store_true', help='create the repo private')
    parser.add_argument('--revision', help='branch to push to (created from main if missing; default main)')
    parser.add_argument('--create-pr', action='store_true', help='open a pull request against main instead')
    parser.add_argument('--commit-message', help='commit title')
    parser.add_argument('--token', help='Hub token (default: HF_TOKEN or the saved login)')
    parser.add_argument('--dry-run', action='store_true', help='show what would be uploaded where, upload nothing')
    args = parser.parse_args(argv)

    result = push_to_hub(
        args.folder,
        args.repo_id,
        private=args.private,
        revision=args.revision,
        create_pr=args.create_pr,
        commit_message=args.commit_message,
        token=args.token,
        dry_run=args.dry_run,
    )
    if args.dry_run:
        print(f'dry run, nothing uploaded:\n{result.describe()}')
    else:
        print(result.pr_url or result.commit_url)
    return 0


if __name__ == '__main__':
    sys.exit(run_main(main))
