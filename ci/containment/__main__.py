import sys

from containment.smoke import main

sys.exit(main())
